"""Step runners: one per KV layout and execution kind, all behind ``base.StepRunner``; ``factory.open_runner``
picks one from the manifest (callers never branch on layouts)."""
