"""The operator console: server-rendered pages at ``/ui`` on the control API's port.

* :mod:`.app`: the console's app, its security headers, and how the API mounts it;
* :mod:`.routes`: the pages (FastAPI router), over :class:`~supervisor.api.control.Control`;
* :mod:`.sessions`: logins (a random id in an HttpOnly cookie) and their CSRF tokens;
* :mod:`.forms`: a form's fields, read with a bound;
* :mod:`.pages`: Jinja2 (autoescape on) and the filters the templates use;
* :mod:`.timeline`: one run's timeline, from what the sidecar keeps;
* :mod:`.charts`: SVG charts (incidents over time, a breaker's states), drawn server-side.

``templates/`` and ``static/`` (one CSS file, a vendored htmx) ship in the wheel.
"""
