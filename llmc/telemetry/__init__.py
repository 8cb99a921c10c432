"""What a build tells whoever watches it: progress bars and machine-readable lines (progress), durable-point events (events)."""
