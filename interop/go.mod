module github.com/idemhq/idem/interop

go 1.26.8

require github.com/idemhq/idem v0.0.0

require github.com/stripe/stripe-go/v82 v82.5.1

replace github.com/idemhq/idem => ../
