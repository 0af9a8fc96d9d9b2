"""Jinja templates for the kernels that `ftc compile` generates (package data of the compiler)."""
