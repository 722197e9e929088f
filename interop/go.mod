module github.com/idemhq/idem/interop

go 1.26.8

require github.com/idemhq/idem v0.0.0

require github.com/stripe/stripe-go/v82 v82.5.1

require (
	github.com/chromedp/cdproto v0.159.0 // indirect
	github.com/chromedp/chromedp v0.23.0 // indirect
	github.com/go-json-experiment/json v0.0.0-20260213210345-44df1a37e875 // indirect
)

replace github.com/idemhq/idem => ../
