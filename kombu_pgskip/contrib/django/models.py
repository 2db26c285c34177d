"""No models. The module is here because Django sends ``pre_migrate`` only to the apps that
have one, and the app's receiver (``schema.upgrade_before_migrate``) needs it."""
