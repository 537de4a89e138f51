"""The compiler: the compile driver and plan, the cache, the manifest writer; frontends/, decoder/ and
verification/ (the pass base, pipelines and parity live in precast.ir, below passes and targets)."""
