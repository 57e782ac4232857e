{{/* Chart name, overridable, cut to 63 characters because it becomes a label value. */}}
{{- define "kv-offload.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{/* Prefix of every object name: "<release>-<chart>" unless the release name already contains the chart name. */}}
{{- define "kv-offload.fullname" -}}
{{- if .Values.fullnameOverride -}}
{{- .Values.fullnameOverride | trunc 63 | trimSuffix "-" -}}
{{- else -}}
{{- $name := default .Chart.Name .Values.nameOverride -}}
{{- if contains $name .Release.Name -}}
{{- .Release.Name | trunc 63 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name $name | trunc 63 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}
{{- end -}}

{{/* "name-version" for the helm.sh/chart label, with "+" made label-safe. */}}
{{- define "kv-offload.chart" -}}
{{- printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{/* Labels on every object, so `kubectl get all -l app.kubernetes.io/instance=<release>` finds them. */}}
{{- define "kv-offload.baseLabels" -}}
helm.sh/chart: {{ include "kv-offload.chart" . }}
app.kubernetes.io/name: {{ include "kv-offload.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
app.kubernetes.io/part-of: kv-offload
{{- end -}}

{{/* Labels of the operator's objects: the base labels plus its component. */}}
{{- define "kv-offload.labels" -}}
{{ include "kv-offload.baseLabels" . }}
app.kubernetes.io/component: operator
{{- end -}}

{{/* The immutable subset of labels that the Deployment and the Services select the operator pod by. */}}
{{- define "kv-offload.selectorLabels" -}}
app.kubernetes.io/name: {{ include "kv-offload.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/component: operator
{{- end -}}

{{/* The ServiceAccount the operator runs as: created, or an existing one named by the user. */}}
{{- define "kv-offload.serviceAccountName" -}}
{{- if .Values.serviceAccount.create -}}
{{- default (include "kv-offload.fullname" .) .Values.serviceAccount.name -}}
{{- else -}}
{{- .Values.serviceAccount.name -}}
{{- end -}}
{{- end -}}

{{/* One image reference for operator, sidecar and test pod: a digest wins over the tag, the tag defaults to appVersion. */}}
{{- define "kv-offload.image" -}}
{{- if .Values.image.digest -}}
{{- printf "%s@%s" .Values.image.repository .Values.image.digest -}}
{{- else -}}
{{- printf "%s:%s" .Values.image.repository (default .Chart.AppVersion .Values.image.tag) -}}
{{- end -}}
{{- end -}}

{{/* The image the webhook injects as the sidecar: the operator's own unless overridden. */}}
{{- define "kv-offload.sidecarImage" -}}
{{- default (include "kv-offload.image" .) .Values.sidecar.image -}}
{{- end -}}

{{/* The Service in front of the operator: webhook (443) and health port; also the certificate's DNS name. */}}
{{- define "kv-offload.serviceName" -}}
{{- include "kv-offload.fullname" . -}}
{{- end -}}

{{/* The Secret holding the webhook's serving certificate, written by Helm or by cert-manager. */}}
{{- define "kv-offload.webhookCertSecret" -}}
{{- printf "%s-webhook-tls" (include "kv-offload.fullname" .) -}}
{{- end -}}

{{/* The DNS names the API server may use to reach the webhook Service; the certificate must cover them. */}}
{{- define "kv-offload.webhookDNSNames" -}}
{{- $svc := include "kv-offload.serviceName" . -}}
{{- $ns := .Release.Namespace -}}
{{- list $svc (printf "%s.%s" $svc $ns) (printf "%s.%s.svc" $svc $ns) (printf "%s.%s.svc.cluster.local" $svc $ns) | toJson -}}
{{- end -}}

{{/* The cert-manager Certificate's name, needed by the cainjector annotation. */}}
{{- define "kv-offload.certificateName" -}}
{{- printf "%s-webhook" (include "kv-offload.fullname" .) -}}
{{- end -}}

{{/* The label that marks a pod as a member of a pool; webhook, PodMonitor and NetworkPolicy select by it. */}}
{{- define "kv-offload.poolLabel" -}}
kv-offload.io/pool
{{- end -}}

{{/* Combinations that cannot work: stop the install with a sentence saying what to change. */}}
{{- define "kv-offload.validate" -}}
{{- if and .Values.monitoring.prometheusRule.enabled (not .Values.monitoring.podMonitor.enabled) (not .Values.monitoring.serviceMonitor.enabled) -}}
{{- fail "monitoring.prometheusRule.enabled is true but neither monitoring.podMonitor nor monitoring.serviceMonitor is: the alerts select the series those monitors scrape; turn one of them on." -}}
{{- end -}}
{{- if and (not .Values.serviceAccount.create) (not .Values.serviceAccount.name) -}}
{{- fail "serviceAccount.create is false but serviceAccount.name is empty: name an existing ServiceAccount or set serviceAccount.create=true." -}}
{{- end -}}
{{- if and .Values.webhook.certManager.enabled (eq .Values.webhook.certManager.issuerRef.kind "ClusterIssuer") (not .Values.webhook.certManager.issuerRef.name) -}}
{{- fail "webhook.certManager.issuerRef.kind is ClusterIssuer but issuerRef.name is empty: name the ClusterIssuer, or set kind=Issuer to let the chart create a self-signed Issuer." -}}
{{- end -}}
{{- if and .Values.networkPolicy.enabled .Values.monitoring.podMonitor.enabled (not .Values.networkPolicy.monitoringNamespace) -}}
{{- fail "networkPolicy.monitoringNamespace is empty while monitoring.podMonitor.enabled is true: the NetworkPolicy would block Prometheus; set networkPolicy.monitoringNamespace to Prometheus' namespace." -}}
{{- end -}}
{{- $first := int .Values.sidecar.controlPort -}}
{{- $last := add $first (int .Values.sidecar.controlPortCount) -1 | int -}}
{{- $data := int .Values.sidecar.dataPort -}}
{{- if gt $last 65535 -}}
{{- fail (printf "sidecar.controlPort + sidecar.controlPortCount - 1 = %d is above 65535: lower sidecar.controlPort or sidecar.controlPortCount." $last) -}}
{{- end -}}
{{- if and (ge $data $first) (le $data $last) -}}
{{- fail (printf "sidecar.dataPort %d lies in the control port range %d-%d: move sidecar.dataPort out of it or lower sidecar.controlPortCount." $data $first $last) -}}
{{- end -}}
{{- if .Values.networkPolicy.enabled -}}
{{- if not .Values.networkPolicy.pools -}}
{{- fail "networkPolicy.enabled is true but networkPolicy.pools is empty: list each pool as {name, namespace} so that its sidecar ports admit only its own pods." -}}
{{- end -}}
{{- $seen := dict -}}
{{- range .Values.networkPolicy.pools -}}
{{- $key := printf "%s/%s" (.namespace | default $.Release.Namespace) .name -}}
{{- if hasKey $seen $key -}}
{{- fail (printf "networkPolicy.pools lists pool %s twice: keep one entry per pool." $key) -}}
{{- end -}}
{{- $_ := set $seen $key true -}}
{{- $poolFirst := int (.basePort | default $.Values.sidecar.controlPort) -}}
{{- $poolLast := add $poolFirst (int (.controlPortCount | default $.Values.sidecar.controlPortCount)) -1 | int -}}
{{- $poolData := int (.dataPort | default $.Values.sidecar.dataPort) -}}
{{- if and (ge $poolData $poolFirst) (le $poolData $poolLast) -}}
{{- fail (printf "networkPolicy.pools entry %s: dataPort %d lies in its control port range %d-%d: give the pool's spec.sidecar.dataPort and basePort as they are, or lower controlPortCount." $key $poolData $poolFirst $poolLast) -}}
{{- end -}}
{{- range $.Values.networkPolicy.servingPorts -}}
{{- if or (eq (int .) $poolData) (and (ge (int .) $poolFirst) (le (int .) $poolLast)) -}}
{{- fail (printf "networkPolicy.servingPorts lists %d, a sidecar port of pool %s: opening it to everyone would bypass the pool-only rule; remove it from networkPolicy.servingPorts." (int .) $key) -}}
{{- end -}}
{{- end -}}
{{- end -}}
{{- range .Values.networkPolicy.servingPorts -}}
{{- if or (eq (int .) $data) (and (ge (int .) $first) (le (int .) $last)) -}}
{{- fail (printf "networkPolicy.servingPorts lists %d, a sidecar port: opening it to everyone would bypass the pool-only rule; remove it from networkPolicy.servingPorts." (int .)) -}}
{{- end -}}
{{- end -}}
{{- end -}}
{{- end -}}

{{/* The kopf peering object the operator replicas share (one per release): only the oldest replica reconciles. */}}
{{- define "kv-offload.peeringName" -}}
{{- include "kv-offload.fullname" . -}}
{{- end -}}

{{/* The job label of the sidecars' scrape target (set by the PodMonitor); the alerts select it. */}}
{{- define "kv-offload.sidecarJob" -}}
{{- printf "%s-sidecars" (include "kv-offload.fullname" .) -}}
{{- end -}}

{{/* The job label of the operator's scrape target (set by the ServiceMonitor); the alerts select it. */}}
{{- define "kv-offload.operatorJob" -}}
{{- printf "%s-operator" (include "kv-offload.fullname" .) -}}
{{- end -}}

{{/* Name of the webhook certificate hook Jobs, their ServiceAccount and RBAC (self-managed certificate). */}}
{{- define "kv-offload.webhookCertJob" -}}
{{- printf "%s-webhook-cert" (include "kv-offload.fullname" .) -}}
{{- end -}}
