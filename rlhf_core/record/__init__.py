"""The run's record in the store: its path grammar, iteration store, manifests, leases, the checkpoint plan, retention, lineage and audit."""
