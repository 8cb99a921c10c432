"""Data sources for calibration and evaluation: schema (`sources`), loaders by kind (`registry`, `loaders`),
chat templates (`chat`), token windows / samples with provenance (`tokens`), overlap checks (`hygiene`)."""
