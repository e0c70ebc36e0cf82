# Third-party suites vendored for tests that run them in a temporary copy (their own
# environment: python-magic's needs LC_ALL=en_US.UTF-8 at import): never collected here.
collect_ignore_glob = ["*"]
