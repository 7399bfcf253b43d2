"""Online serving: an OpenAI-compatible Ray Serve app with a staging queue and admission control.

`build_app(ServeConfig(...))` is the Serve application, and `pipeline.serve:build_app` is Ray
Serve's app builder (`serve run pipeline.serve:build_app model=... num_replicas=2`, or a `serve
deploy` config file: docs/serve-config.yaml); see README "Online serving".
"""

from pipeline.serve.config import ServeConfig

__all__ = ["ServeConfig", "build_app"]


def __getattr__(name: str) -> object:
    # build_app imports ray.serve; load it only when asked for.
    if name == "build_app":
        from pipeline.serve.app import build_app

        return build_app
    raise AttributeError(name)
