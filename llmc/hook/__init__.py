"""The registry hook: a model registry announces a new checkpoint, llmc builds, gates and registers its variants.

`signatures` verifies deliveries (MLflow's HMAC, the Hugging Face Hub's shared secret), `config` maps registered
models to recipes, `queue` is the durable on-disk job queue, `jobs` runs one job (fetch the source, build, register),
`payloads` validates what deliveries carry, `server` is `llmc hook serve` (a Flask app and its one worker thread)
and `http_server` the waitress server it runs on, with connection limits and timeouts.
"""
