"""AstrAI training deployment: run PyTorch training jobs in Docker from one YAML file."""
