"""tandem engines package."""
