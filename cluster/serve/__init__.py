"""A warm training service behind the Tinker API (`python -m cluster.serve CONFIG`; docs/service.md)."""
