"""Tandem's Ray actors: `BackendActor` (one engine on one device) and `RouterActor` (the router
and its ledgers). The classes are plain Python; the launcher (cluster/launcher.py) turns them into
Ray actors with the options each needs, so they can also be driven directly in tests."""
