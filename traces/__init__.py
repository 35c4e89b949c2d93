"""tandem traces package."""
