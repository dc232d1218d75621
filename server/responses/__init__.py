"""/v1/responses, OpenAI's Responses API, served through the chat path.

- ``handler``: the endpoint's handler, its typed stream events, and GET/DELETE by id;
- ``to_chat``: a Responses request as the chat request that serves it, and what is refused;
- ``store``: stored responses for ``previous_response_id`` (bounded, least recently used).

The chat and completion bodies of the other endpoints are ``server.bodies``.
"""
