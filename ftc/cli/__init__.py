"""The `ftc` command line: parses arguments, calls the compiler and runtime, prints results."""
