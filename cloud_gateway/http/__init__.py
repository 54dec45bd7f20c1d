"""The HTTP port: routes (``api``), tokens and mTLS (``auth``), what handlers share
(``state``), the API's documents (``models``, ``fleet_documents``, ``bie``), the OpenAPI
document, and the operator page (``ui``)."""
