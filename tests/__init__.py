"""The test suite. Each directory is a package, so a package-scoped fixture (a shared stack, a real vLLM) is
stopped when the last test of its directory ends instead of idling through the rest of the run."""
