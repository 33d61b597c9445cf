"""The engine's prefix cache backed by the node stores: publishing what an engine retains, fetching
what another engine computed. Needs torch (it decodes into the engine's layer states), so it lives
under the engine, not beside the torch-free worker helpers."""
