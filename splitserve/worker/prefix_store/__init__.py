"""A worker's side of the cluster prefix cache: publishing what its engine retains to the node's
store, fetching what another engine computed. They talk to the stores over gRPC, so they live with
the workers, not in the engine (which never imports gRPC); the tensors they carry are encoded and
decoded by the engine's `state_codec`, imported where it is used, so these modules load without
torch (the controller's node imports the worker packages on the base install)."""
