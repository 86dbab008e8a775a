"""The `aenv` command line: thin shells over library calls."""
