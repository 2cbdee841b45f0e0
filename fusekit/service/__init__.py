"""The fusion service: clients submit checkpoints over HTTP, workers fuse them as jobs.

``fusekit serve`` runs it (:func:`fusekit.service.server.serve`); ``fusekit.client`` and
``fusekit submit`` / ``fusekit job`` talk to it. Needs the ``serve`` extra.
"""
