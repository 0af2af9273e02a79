"""The API server's routes by endpoint family: `openai` (completions, chat), `native` (/generate),
`admin` (health, models, metrics, debug state) and `schema` (the OpenAPI document). `generation` holds what
the generation endpoints share, `common` what every route does."""
