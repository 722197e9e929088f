package cli

// The internal tests' helpers, for the external tests (package cli_test).
var (
	EnvOf     = envOf
	WriteFile = writeFile
)
