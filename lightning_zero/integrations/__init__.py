"""Layer 5, integrations: the only package that imports Lightning. One shared front end
(:mod:`lightning_zero.integrations.frontend`), then the Trainer strategy (``trainer/``) and the
Fabric strategy (``fabric/``)."""
