"""HTTP serving: OpenAI-compatible routes over a scheduler that batches requests' decode steps."""
