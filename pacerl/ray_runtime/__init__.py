"""`runtime = "ray"`: the run's parts as Ray actors (docs/ray.md)."""
