"""The cluster side of the pipeline: KubeRay objects from a run config, rendered,
validated, created and torn down through the Kubernetes API. Knows Kubernetes, never
tensors: it reads configs and writes dicts."""
