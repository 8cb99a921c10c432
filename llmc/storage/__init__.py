"""The content-addressed stage cache and atomic writes (store), identical files stored once (links), path confinement (paths), resource errors recognised once (resource_errors)."""
