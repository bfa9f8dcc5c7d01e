"""See docs/design.md for what this package owns."""
