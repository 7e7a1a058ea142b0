"""The HTTP room every role's port is built from: body reading and JSON replies (app.py), OpenAI's error
schema and its handlers (errors.py), the API-key middleware and its reload swap (auth.py), the probes and
/admin/state every role answers the same way (admin.py), and the public port's header guard (guard.py).
It knows no engine, router or store: a role hands it functions."""
