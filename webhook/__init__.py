"""``spotdrain webhook``: a mutating admission webhook that gives Pods the sidecar at creation, as ``spotdrain
inject`` gives it to pod templates (both call ``inject.pods``)."""
