"""Scale-out: tandem replicas behind one OpenAI endpoint on Ray Serve. `ray_serve.py` builds the application
(ingress + replicas), `router.py` routes by prefix and load, `autoscale_policy.py` scales on tandem's own
signals, `k8s/` holds the KubeRay `RayService` and KEDA manifests. Needs the `ray` extra.
"""
