"""The Model Context Protocol server: ``server`` (tools and the prompt),
``local`` (tools over a database file) and ``fleet`` (over a live fleet), ``answers``
(what each tool answers), ``prompts``, ``safety`` (traced strings marked as data,
results that fit) and ``https`` (served under the agent's TLS rules).
"""
