"""The study report: loads the tidy tables and published numbers, draws, renders HTML."""
