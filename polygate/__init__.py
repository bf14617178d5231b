"""polygate: a trio-native LLM gateway library (placeholder surface, filled in below)."""
