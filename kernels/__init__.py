"""tandem kernels package."""
