"""Integrations of flashjit's attention into other libraries (imported on demand)."""
