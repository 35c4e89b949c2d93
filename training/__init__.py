"""Training of the embedded default models (`tandem-tiny-s`, `tandem-tiny-l`): the corpus and the loop.

Not part of serving: `engines/` and `gateway/` never import this package; `router_model.labels` imports the
corpus lazily, as the labelling tool's own need.
"""
