"""``pagedq serve``: an OpenAI-compatible HTTP gateway over the queue, and the fleet dashboard.

The gateway is stateless and talks to Redis only, through the wire protocol (``schemas``) and the producer
client (``worker.client``): each HTTP request becomes one job, and the response is read back from the job's
reply stream. So any number of gateway replicas can sit in front of any number of workers, and a worker can
die mid-request without the client noticing (the job is redelivered; the gateway follows ``attempt``).
Nothing here imports torch or the engine: the gateway starts in well under a second.
"""
