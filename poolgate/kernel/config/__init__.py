"""The one poolgate configuration file: typed, frozen, validated at load.

Errors name the field path (``pools.1.name``) and what to do; a bad value never falls back silently to a
default. Every process reads the same file: its ``main`` loads the whole ``Config`` and hands each part
the section it reads. Where each section is declared:

- ``loader``: ``Config`` (the top level and the checks across sections), ``parse_config``, ``load_config``,
  ``load_process_config``;
- ``processes``: ``ports``, ``extproc``, ``controller``, ``observability``;
- ``agent``: ``agent`` (scrape interval, GPU source: NVML, dcgm-exporter or Prometheus);
- ``scheduling``: ``scheduling`` (task classes, scorer names, weights and bounds);
- ``pools``: ``pools`` and ``workers``;
- ``disaggregation``: ``disaggregation`` (prefill/decode split: threshold, sidecar);
- ``lifecycle``: ``health``, ``drain``, ``placement``, ``autoscale``, ``kubernetes``;
- ``tenancy``: ``tenancy`` and ``tenants``;
- ``catalogue``: ``catalogue`` (models, versions, aliases, LoRA adapters);
- ``transport``: ``tls`` (certificate files for the parts' TLS, mutual TLS);
- ``base``: ``ConfigError`` and the frozen ``Section`` every section derives from.
"""

from poolgate.kernel.config.agent import AgentSettings, DcgmExporterSettings, PrometheusGpuSettings
from poolgate.kernel.config.base import ConfigError, Section
from poolgate.kernel.config.catalogue import (
    MODEL_NAME_PATTERN,
    AliasRule,
    CatalogueModel,
    CatalogueSettings,
    LoraAdapter,
    ModelVersion,
    ParameterValue,
)
from poolgate.kernel.config.disaggregation import DisaggregationSettings
from poolgate.kernel.config.lifecycle import (
    MAX_COLD_START_WAIT_S,
    AutoscaleSettings,
    DrainSettings,
    HealthSettings,
    KubernetesSettings,
    PlacementSettings,
    PoolScaling,
    WorkerTemplate,
)
from poolgate.kernel.config.loader import Config, load_config, load_process_config, parse_config
from poolgate.kernel.config.pools import PoolRole, PoolSpec, PoolTask, PoolTokenizer, WorkerSpec, has_flag
from poolgate.kernel.config.processes import (
    ControllerSettings,
    ExtprocSettings,
    KvEventsSettings,
    ObservabilitySettings,
    Ports,
)
from poolgate.kernel.config.scheduling import (
    MAX_WAIT_LIMIT_S,
    LearnedOutputSettings,
    SchedulingSettings,
    TaskClass,
    TaskClassRules,
)
from poolgate.kernel.config.tenancy import PRIORITY_CLASS_PATTERN, PriorityClass, TenancySettings, TenantSpec
from poolgate.kernel.config.transport import TlsClientFiles, TlsServerFiles, TlsSettings

__all__ = [
    "MAX_COLD_START_WAIT_S",
    "MAX_WAIT_LIMIT_S",
    "MODEL_NAME_PATTERN",
    "PRIORITY_CLASS_PATTERN",
    "AgentSettings",
    "AliasRule",
    "AutoscaleSettings",
    "CatalogueModel",
    "CatalogueSettings",
    "Config",
    "ConfigError",
    "ControllerSettings",
    "DcgmExporterSettings",
    "DisaggregationSettings",
    "DrainSettings",
    "ExtprocSettings",
    "HealthSettings",
    "KubernetesSettings", "KvEventsSettings", "LearnedOutputSettings",
    "LoraAdapter",
    "ModelVersion",
    "ObservabilitySettings",
    "ParameterValue",
    "PlacementSettings",
    "PoolRole",
    "PoolScaling",
    "PoolSpec",
    "PoolTask", "PoolTokenizer",
    "Ports",
    "PriorityClass",
    "PrometheusGpuSettings",
    "SchedulingSettings",
    "Section",
    "TaskClass",
    "TaskClassRules",
    "TenancySettings",
    "TenantSpec",
    "TlsClientFiles",
    "TlsServerFiles",
    "TlsSettings",
    "WorkerSpec",
    "WorkerTemplate",
    "has_flag",
    "load_config",
    "load_process_config",
    "parse_config",
]
