"""The gateway's HTTP routes, one APIRouter per concern; `frontend.app` mounts them.

Routes reach the gateway's parts through `request.app.state` (see `frontend.routes.state`),
so each module is a plain APIRouter with no wiring of its own.
"""
