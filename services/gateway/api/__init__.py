"""The OpenAI HTTP edge: request bodies, routes, auth, errors, response bodies."""
