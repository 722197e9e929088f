module github.com/idemhq/idem

go 1.26.8
