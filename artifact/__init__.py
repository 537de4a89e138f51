"""The artifact contract between compiler and runtime: what is on disk and how it is read and trusted.

``schema`` (typed records), ``manifest`` (the top-level record, read and integrity), ``target_blocks`` (one
record per backend), ``llm_spec`` / ``stages_spec`` (the llm and stages blocks), ``staging`` (atomic writes),
``archive`` (packing, safe unpacking) and ``signing`` (signed statements). Imports nothing of precast's but
``precast.errors``: the compiler writes these records, the runtime reads them.
"""
