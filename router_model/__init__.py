"""tandem router_model: prompt features, router training and calibration, evaluation, artifact load/save.

Serving needs only `Router.load(folder)`, `router.score(conversation)` and `router.decide(conversation)`.
"""

from router_model.features import KNOWN_EXTRAS, FeatureConfig, Featurizer
from router_model.router import MissingExtraFeature, Router, RouterArtifactError

__all__ = ["KNOWN_EXTRAS", "FeatureConfig", "Featurizer", "MissingExtraFeature", "Router", "RouterArtifactError"]
