"""`trnd router`: the OpenAI front of a deployment with several decode servers (xPyD).

targets.py probes the decode servers and learns what each serves; policy.py picks one per request
(fit, session, prefix, load); proxy.py sends it there, fails over, relays the answer; app.py is the
HTTP front. The process around them is trnd/roles/router.py.
"""
