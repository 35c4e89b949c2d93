"""tandem router_model package."""
