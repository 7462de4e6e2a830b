"""Raw files to tidy tables and derived quantities; the formulas and the roofline cost model."""
