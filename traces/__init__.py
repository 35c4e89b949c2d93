"""tandem traces: workload mixes, trace readers, prompt synthesis, the open-loop load generator, metrics and
reports behind `tandem loadtest`. A client of the gateway over HTTP only (no gateway, engines or torch).
"""
