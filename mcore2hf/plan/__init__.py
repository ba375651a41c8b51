"""The plan layer: decisions made once per export setting, identical on every rank, as plain data. The export plan
(`export`: the global source table, byte-bounded buckets), the planner that builds and caches it (`planner`), the
one check of a model against its HF config (`checks`), the export options (`options`), the engine sharding rules
(`engine_shards`), the engine-shard planner (`engine`) and the route rule of point-to-point exports (`routes`).
Imports only the architecture layer and below; nothing here moves a tensor between ranks."""
