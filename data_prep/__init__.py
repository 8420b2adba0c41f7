"""Task-pool preparation: SWE-smith and SETA-Env sources, validation, filters, splits."""
