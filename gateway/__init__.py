"""tandem gateway package."""
